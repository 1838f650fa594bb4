import sys

from llmem.simulate.cli import main

sys.exit(main())
