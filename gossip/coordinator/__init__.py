"""The parameter-server emulation (ps-* modes): one server loop (``server``) around a pure state machine
(``core``: versions, barriers, bounded staleness), one small file per update rule (``sgd``, ``dcasgd``,
``averaging``), the mode table (``modes``) and the worker side (``worker``)."""
