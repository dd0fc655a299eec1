"""WebSocket routes; each app contributes its consumers here."""

websocket_urlpatterns: list = []
