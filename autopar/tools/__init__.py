"""Entry-layer tools that run the native runtime outside a compiled step: ``bench`` (the
collectives' latency and bus bandwidth) and ``calibrate`` (this machine's constants into a
``Topology``). In: command-line options; out: measurements."""
