"""HAProxy in front of several gateways: one port, health checks on ``/ready``."""
