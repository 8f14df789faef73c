def fit_tables(*a, **k): raise NotImplementedError
