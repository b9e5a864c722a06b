def install_messages(app, ctx): pass
