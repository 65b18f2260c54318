import sys

from interp.cli import main

sys.exit(main())
