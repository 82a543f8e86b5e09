import sys

from outboxkit.cli import main

sys.exit(main())
