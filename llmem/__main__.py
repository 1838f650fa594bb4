import sys

from llmem.cli import main

sys.exit(main())
