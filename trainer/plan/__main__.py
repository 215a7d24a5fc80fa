from trainer.plan.report import main

main()
