from ckpt_cli.main import main

main()
