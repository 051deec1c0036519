import sys

from libs.client.cli import main

sys.exit(main())
