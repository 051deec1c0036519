import sys

from services.agent.dataplane.process import main

sys.exit(main())
