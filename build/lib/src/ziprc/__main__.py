import sys

from src.ziprc.pipeline import main

sys.exit(main())
