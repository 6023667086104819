from glm5_cli.main import main

main()
