from gossip.exit import exit_now
from launch.cli import main

exit_now(main())
