"""The benchmark harness: the cases and their training step (``cases``), the step's profile and host-sync
search (``profile``), the aten-op classifier (``aten_ops``), and the benchmarks and censuses built on them
(``train``, ``linear``, ``host``, ``launch_inventory``, ``op_census``, ``saved_census``, ``checkpoint``). Each
tool has a ``main()``; ``scripts/`` holds their command lines (``docs/benchmarks.md``: commands and numbers).
"""
