"""`python -m lorakit ARGS`: the C CLI, as the `lorakit` console command."""
import sys

from ._cli import main

sys.exit(main())
