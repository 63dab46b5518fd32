import sys

from local.stack.cli import main

sys.exit(main())
