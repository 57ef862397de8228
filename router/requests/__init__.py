"""A request's way through the router: admission, the placement walk, migration after a failure."""
