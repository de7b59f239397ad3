from genqueue.cli import main

raise SystemExit(main())
