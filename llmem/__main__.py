import os
import sys

from llmem.cli import main

try:
    code = main()
    sys.stdout.flush()
except BrokenPipeError:
    # the reader of stdout went away (`llmem estimate ... | head`): no traceback; Python's documented way out
    # (docs.python.org "Note on SIGPIPE"): point stdout at devnull so the interpreter's final flush cannot raise again
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    code = 1
sys.exit(code)
