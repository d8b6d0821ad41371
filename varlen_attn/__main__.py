"""``python -m varlen_attn [options] script.py ARGS``: see :mod:`varlen_attn.launch` (``--help``)."""

from .launch import main

main()
