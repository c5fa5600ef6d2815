import sys

from pfcompile.cli import main

sys.exit(main())
