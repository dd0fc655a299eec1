"""Runnable examples of training with the Nightwatch hooks."""
