"""Experiment code, apart from the library core: the embedded IMDb data (:mod:`.imdb`), the sentiment RLHF
pipeline behind ``./scripts/main`` (:mod:`.pipeline`) and the linear BTL world of the theory (:mod:`.linear`).
It uses the core's public pieces; the core never imports it."""
