"""The session machine (``toolkv.core.session.machine``) and its parts: its state (``state``), the
copy path (``copies``), the loads (``loads``), the hand-over (``handover``), the policy's actions
(``policy_actions``) and the L3 sub-machine (``l3``).

Nothing is imported here: the records and phases every floor reads are on core's ground floor
(``toolkv.core.record``, ``toolkv.core.phases``), below the backends that this floor imports.
"""
