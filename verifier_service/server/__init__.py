"""The grading service: ``settings`` (declared, ``STAPO_VERIFIER_*``) <- ``pool`` (grading processes
with hard deadlines; its ``scheduler``, ``cache`` and ``warmup``) <- the FastAPI app (``app``, ``deps``,
``routes/``, ``middleware``, ``metrics``, ``responses``); ``schemas`` is the wire format."""
