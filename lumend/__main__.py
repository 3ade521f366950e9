from lumend.cli import main

main()
