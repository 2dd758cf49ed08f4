import sys

from raysys.cli import main

sys.exit(main())
