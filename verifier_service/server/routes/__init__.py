"""The service's routers, one per concern: ``verify`` (``POST /v1/verify``), ``openrlhf``
(``POST /get_reward``) and ``ops`` (``/healthz``, ``/readyz``, ``/metrics``); ``server.app`` mounts them."""
