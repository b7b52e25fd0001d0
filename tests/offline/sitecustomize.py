"""A machine without internet, for the tests: Python imports this module at start-up when
PYTHONPATH names its folder, and from then on every connection fails as it does offline."""

import socket


def _no_route(*args, **kwargs):
    raise OSError(113, "No route to host")


socket.create_connection = _no_route
socket.socket.connect = _no_route
