"""What turns the engine into a service: the typed engine protocol (``protocol``), the
``EngineClient`` a gRPC edge uses (``client``), the engine loop and its ports (``loop``,
``link``), the edge process (``edge``), the engine service (``engine_service``,
``dp_launcher``), the ``ServiceHost`` all five services run in (``host``), and the
conversions between the protocol's types and the gRPC messages (``proto_convert``)."""
