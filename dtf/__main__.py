from dtf.cli import main
from dtf.results import exit_code, exit_now

if __name__ == "__main__":
    try:
        main()
        code = 0
    except SystemExit as e:
        code = exit_code(e)
    exit_now(code)
