"""The htmx dashboard (DESIGN §7): runs list, run page, new-run form, placement explorer, run comparison,
hosts page, login.

Server-rendered Jinja2 pages over `server.services` (no HTTP calls to our own API), with one partial per
htmx swap target; htmx and uPlot come from npm at install time (`package.json`, never committed). Every
page reads without JavaScript; live updates and charts are what the scripts add.

  app.py        register(app, settings): the plugin entry point
  auth.py       cookie sessions made from API tokens, CSRF tokens
  routing.py    the route class that renders errors as HTML
  templating.py Jinja2 environment, filters, render()
  charts.py     which metrics the charts show, shaped for uPlot
  run_page.py   what the run page reads
  forms.py      the new-run form: fields -> RunSpec, errors -> where they show
  routes/       one router per page family
"""
