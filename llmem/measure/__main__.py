import sys

from llmem.measure.cli import main

sys.exit(main())
