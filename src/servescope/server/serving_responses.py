def install_responses(app, ctx): pass
