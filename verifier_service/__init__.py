"""Math verification for RL rewards, in three parts by role (docs/verifier.md, docs/integrations.md):

- ``grader/``: the grader library, in this process (``stapo.verifier_service.grader``: ``grade``,
  ``extract``, ``compare``); ``parsing`` <- ``rules/`` <- the package's own module.
- ``server/``: the grading service: its settings, the pool of grading processes with hard deadlines
  (``server.pool.GraderPool``) and its scheduler and caches, and the FastAPI app over the pool
  (``server.app.create_app``, ``server/routes/``).
- ``clients/``: what talks to the service or stands in for it: the HTTP client (``clients.client``),
  the adapters for verl, OpenRLHF and TRL (``clients.adapters``), the load generator (``clients.loadgen``).

Imports point one way: grader <- server <- clients. The module paths of the flat layout
(``stapo.verifier_service.pool``, ``.client``, ``.adapters``, ...) import for one release, with a
DeprecationWarning naming the new path (:data:`MOVED`, :mod:`stapo.moved`).
"""

from __future__ import annotations

from stapo.moved import register

MOVED = {
    "stapo.verifier_service.dapo": "stapo.verifier_service.grader.dapo",
    "stapo.verifier_service.extract": "stapo.verifier_service.grader.extraction",
    "stapo.verifier_service.mathverify": "stapo.verifier_service.grader.mathverify",
    "stapo.verifier_service.normalize": "stapo.verifier_service.grader.normalize",
    "stapo.verifier_service.numeric": "stapo.verifier_service.grader.numeric",
    "stapo.verifier_service.parsing": "stapo.verifier_service.grader.parsing",
    "stapo.verifier_service.rules": "stapo.verifier_service.grader.rules",
    "stapo.verifier_service.rules.numbers": "stapo.verifier_service.grader.rules.numbers",
    "stapo.verifier_service.rules.rejections": "stapo.verifier_service.grader.rules.rejections",
    "stapo.verifier_service.rules.strings": "stapo.verifier_service.grader.rules.strings",
    "stapo.verifier_service.rules.structure": "stapo.verifier_service.grader.rules.structure",
    "stapo.verifier_service.rules.symbolic": "stapo.verifier_service.grader.rules.symbolic",
    "stapo.verifier_service.rules.table": "stapo.verifier_service.grader.rules.table",
    "stapo.verifier_service.app": "stapo.verifier_service.server.app",
    "stapo.verifier_service.cache": "stapo.verifier_service.server.cache",
    "stapo.verifier_service.deps": "stapo.verifier_service.server.deps",
    "stapo.verifier_service.metrics": "stapo.verifier_service.server.metrics",
    "stapo.verifier_service.middleware": "stapo.verifier_service.server.middleware",
    "stapo.verifier_service.pool": "stapo.verifier_service.server.pool",
    "stapo.verifier_service.responses": "stapo.verifier_service.server.responses",
    "stapo.verifier_service.routes_openrlhf": "stapo.verifier_service.server.routes.openrlhf",
    "stapo.verifier_service.routes_ops": "stapo.verifier_service.server.routes.ops",
    "stapo.verifier_service.routes_verify": "stapo.verifier_service.server.routes.verify",
    "stapo.verifier_service.scheduler": "stapo.verifier_service.server.scheduler",
    "stapo.verifier_service.schemas": "stapo.verifier_service.server.schemas",
    "stapo.verifier_service.settings": "stapo.verifier_service.server.settings",
    "stapo.verifier_service.warmup": "stapo.verifier_service.server.warmup",
    "stapo.verifier_service.adapters": "stapo.verifier_service.clients.adapters",
    "stapo.verifier_service.client": "stapo.verifier_service.clients.client",
    "stapo.verifier_service.loadgen": "stapo.verifier_service.clients.loadgen",
}
"""Module paths of stapo 0.1's flat ``verifier_service/`` and where the role layout put each
(docs/verifier.md, "Where did it move"). For one release an old path still imports, with a
DeprecationWarning naming the new one; stapo 0.2 drops them."""

register(MOVED, "stapo.verifier_service is laid out by role")
