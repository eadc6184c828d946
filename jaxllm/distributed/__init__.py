"""Past one engine: data-parallel replicas and the router that picks one per request."""
