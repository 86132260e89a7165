"""A module that starts a thread as it is imported: a node cannot fork ranks after
preloading it (a fork copies the locks the thread holds, not the thread), so ranks start as
fresh interpreters (tests/contract/test_preload.py)."""

import threading
import time

threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
