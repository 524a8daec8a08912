from superinfer.operator.main import main

main()
