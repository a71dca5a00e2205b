from kunlun_installer.main import main

main()
