from hpcdl.train.cli import console_main

console_main()
