from lumenctl.main import main

main()
