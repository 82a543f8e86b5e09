import sys

from chaos.runner import main

sys.exit(main())
