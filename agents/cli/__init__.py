"""``nightwatch``: the command line for CI pipelines and operators, over the REST API.

No Django here: it is installed with the agent (the bare install) and speaks only HTTP, with a
token from ``NIGHTWATCH_TOKEN`` (or ``--token`` / ``--token-file``) to ``NIGHTWATCH_URL``.
"""
