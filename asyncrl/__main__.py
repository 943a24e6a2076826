"""``python -m asyncrl ...`` (and ``torchrun --nproc-per-node N -m asyncrl train ...``): the CLI."""
import sys

from asyncrl.cli import main

sys.exit(main())
