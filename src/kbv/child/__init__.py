"""What runs inside a worker process, the side that may hold candidate code.

``python -m kbv.child.main FD ROLE`` is every worker's entry point. This package imports only the
wire modules both sides share (``kbv.channel``, ``kbv.handoff``, ``kbv.processes``,
``kbv.samples``), ``kbv.inputs``, ``kbv.protocol``, ``kbv.telemetry`` and the problem loader:
never a verdict, the store or a comparison, and no trusted module imports this package
(``tests/test_layers.py``). The parent's half, which spawns and contains workers, is ``kbv.worker``.
"""
