"""What crosses process boundaries: message dataclasses, their codec and ZeroMQ transports."""
