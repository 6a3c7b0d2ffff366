from qprep.cli import main

raise SystemExit(main())
