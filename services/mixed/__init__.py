"""A mixed-pool instance: one engine that serves both roles (see :mod:`services.mixed.worker`)."""
