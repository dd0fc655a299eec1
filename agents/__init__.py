"""Node-side Nightwatch: the agent daemon, the training hooks and the wire protocol.

Never imports Django: this package is installed on GPU nodes and imported inside ``train.py``.
"""

__version__ = "0.1.0"
