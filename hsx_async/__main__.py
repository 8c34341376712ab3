from hsx_async.cli import main

raise SystemExit(main())
