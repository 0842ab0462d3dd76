"""PostgreSQL on this host for the nested tier's cluster (tests/e2b/run_nested.sh): the
nested machine reaches it at 10.0.2.100:5432, which tests/nested/run.sh --guestfwd relays
to 127.0.0.1:PORT here.

    nested_pg.py start DIR PORT   start it in DIR/pg (DIR made if absent); print the URL
                                  the nested machine's nodes use
    nested_pg.py stop DIR         stop it (DIR stays: the caller removes it)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import start_postgres, stop_postgres  # noqa: E402

# The address the nested machine sees (QEMU's user network, guestfwd).
L1_ADDR = "10.0.2.100:5432"


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "start":
        d, port = sys.argv[2], int(sys.argv[3])
        os.makedirs(d, exist_ok=True)
        os.chmod(d, 0o755)
        _, url = start_postgres(d, "127.0.0.1", port, "127.0.0.1/32")
        print(url.replace(f"127.0.0.1:{port}", L1_ADDR))
    elif len(sys.argv) == 3 and sys.argv[1] == "stop":
        stop_postgres(os.path.join(sys.argv[2], "pg"))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
