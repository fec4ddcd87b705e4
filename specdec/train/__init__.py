"""Training drafter heads: the data pipeline (`data.build_cache`, `data.FeatureCache`; prompt sources in
`sources`) and the trainers that read it."""
