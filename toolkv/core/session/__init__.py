"""One agent session as the manager sees it: its record (the spec's per-session variables) and its
phases (``Phase``, the lifecycle table's states as an enum).

The session machine itself (``toolkv.core.session.machine``) is not imported here: the backends
import the record, and the machine imports the backends.
"""

from toolkv.core.phases import Phase
from toolkv.core.record import SessionRecord

__all__ = ["Phase", "SessionRecord"]
